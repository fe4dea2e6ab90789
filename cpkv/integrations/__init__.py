"""Adapters from other frameworks' batch descriptions and models to cpkv's plan and pipeline.

* :mod:`cpkv.integrations.megatron`: Megatron-core's ``PackedSeqParams`` (THD, with or
  without TransformerEngine's per-document padding) to an :class:`~cpkv.AttentionPlan`.
* :mod:`cpkv.integrations.transformers`: one Hugging Face ``DeepseekV4Attention`` under CP.
* :mod:`cpkv.integrations.transformers_lm`: a whole ``DeepseekV4ForCausalLM`` under CP, one
  call per micro-batch from packed ids to the rank's loss.
* :mod:`cpkv.integrations.hf_trainer`: Hugging Face's ``Trainer`` training that model under
  CP (a mixin: mesh, sampler, normaliser, reduction, logging, checkpoints).
* :mod:`cpkv.integrations.causal_lm`: labels shifted before sharding and the loss over the CP
  group's valid-label count, for any packed causal LM (no framework).

Each adapter is duck-typed (it reads attributes, it imports no framework at import time), so
importing it never pulls the framework in.
"""
