"""The program forms both halves read: the flat program (a traced step with every value
numbered), the pipeline cut of it, the loss-function markers, the rematerialised loss, and the
pipeline schedules with their simulation.

May import: ``autopar.errors`` and ``autopar.ir`` only (and JAX). The compiler and the runtime
both import this room, so a tensor id or a schedule task means the same thing to both.
"""
