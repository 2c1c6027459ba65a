"""The step engine, in torch terms: a training loop seen as modules, optimizers, a step and a process group, and
the flow that runs the parts in the step's order. It never imports Lightning; the front doors
(:mod:`lightning_numguard.doors`) translate a training loop into it."""
