"""Built-in models; any other nn.Module is reachable through `model._target_`."""
