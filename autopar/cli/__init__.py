"""The ``autopar`` command, the top of the house: ``main`` dispatches to one module per
subcommand (``compile``, ``show``, ``bench``, ``profile``, ``launch``); ``options`` holds the
flags they share, ``sources`` loads the step to plan, ``output`` writes the files a report asks
for.

May import: anything in ``autopar``. Nothing imports it but ``autopar/__main__.py``.
"""

from autopar.cli.main import main

__all__ = ["main"]
