"""Measuring DSpark: a drafter on the held-out eval sets (:mod:`dspark.evaluation.eval_sets`, ``dspark eval``),
acceptance by draft position collected from ``generate()`` (:mod:`dspark.evaluation.acceptance`, also the data of
``dspark calibrate``) and the batched engine under load (:mod:`dspark.evaluation.serving`, ``dspark bench serve``).

Imports ``modeling_dspark``, ``generation`` and ``training`` (prompts, EOS ids); none of them imports this package.
"""
