"""The ``mlxr`` command line (:func:`mlxr_core.cli.main.main`); one module per command."""
