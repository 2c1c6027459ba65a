"""The Lightning Fabric door: ``Fabric(callbacks=[NumGuard()])``, and LitGPT with ``NUMGUARD=1``."""
