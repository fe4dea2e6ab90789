"""Adapters from other frameworks' batch descriptions to cpkv's plan.

* :mod:`cpkv.integrations.megatron`: Megatron-core's ``PackedSeqParams`` (THD, with or
  without TransformerEngine's per-document padding) to an :class:`~cpkv.AttentionPlan`.

Each adapter is duck-typed (it reads attributes, it imports no framework), so importing it
never pulls the framework in.
"""
