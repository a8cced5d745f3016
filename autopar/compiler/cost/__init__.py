"""The cost model: logical meshes with alpha/beta per axis (``mesh``), collectives
(``collectives``), resharding between specs (``resharding``), per-device memory
(``memory_model``), step-time summaries (``estimate``) and the fit of measured profiles to a
cluster description (``calibration_fit``).

May import: ``autopar.compiler.graph``, ``autopar.cluster``, ``autopar.plan``,
``autopar.errors`` and this room.
"""
