"""The Lightning ``Trainer`` door: ``NumGuardCallback`` (both Lightning packages) and its zero-code attach."""
