"""The front doors: thin adapters that translate a training loop into the engine's terms. The only folder of the
package that imports Lightning."""
