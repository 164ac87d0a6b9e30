"""Every training of the product, above the model and the PLOT: the shared fit() loop, calibration
of roots (``calibrate``, ``calibrate_decoder``), tenants' fine-tunes (``finetune`` for encoder
heads, ``finetune_lm`` for decoder LoRA) and domains' further pretraining (``further_pretrain``).
The jobs of the server (``hmi.services.jobs``/``workers``) only launch them."""
