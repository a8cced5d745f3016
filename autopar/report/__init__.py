"""Reports of a plan: text and JSON (``text``), one self-contained HTML page (``html``), the
device mesh and the schedule's swimlane as pictures (``pictures``, ``swimlane``).

May import: ``autopar.plan``, ``autopar.ir``, ``autopar.cluster``, ``autopar.compiler`` (to
describe a plan's graph and mesh), ``autopar.errors``; never ``autopar.runtime`` or
``autopar.frontend``.
"""
