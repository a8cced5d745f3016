"""The ``autopar`` command: ``main`` dispatches to one module per subcommand (``compile``,
``show``, ``bench``, ``profile``, ``launch``); ``options`` holds the flags they share,
``sources`` loads the step to plan, ``output`` writes the files a report asks for."""

from autopar.frontend.cli.main import main

__all__ = ["main"]
