"""Measuring DSpark: a drafter on the held-out eval sets (:mod:`evaluation.eval_sets`, ``dspark eval``), acceptance
by draft position collected from ``generate()`` (:mod:`evaluation.acceptance`, also the data of ``dspark
calibrate``) and the batched engine under load (:mod:`evaluation.serving`, ``dspark bench serve``).

Imports ``modeling_dspark``, ``generation`` and ``training`` (prompts, EOS ids); none of them imports this package.
"""
