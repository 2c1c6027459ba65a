"""The plain-PyTorch door: ``attach(model, optimizer)`` for a training loop the user wrote."""
