"""The Hydra configs, shipped inside the package as ``lightning_hetermoe.conf``.

The recipes compose from this folder; code that reads a config at run time (the named
workload models of ``model/`` for the emulated clock) finds it with ``importlib.resources``,
the same way from a source checkout, an editable install or a wheel.
"""
