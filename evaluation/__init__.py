"""Measuring DSpark: a drafter on the held-out eval sets (:mod:`evaluation.eval_sets`, ``dspark eval``) and the
batched engine under load (:mod:`evaluation.serving`, ``dspark bench serve``), with the statistics of both.

Imports ``modeling_dspark``, ``generation`` and ``training`` (prompts, acceptance labels); none of them imports
this package.
"""
