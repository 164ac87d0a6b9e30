"""hGPT: decoder tenants served the way encoder tenants are.  The decoder root's windows and
upper layers are ``hmi.model.decoder`` and ``decoder_layers``; its calibration and the tenants'
LoRA fine-tunes are in ``hmi.training`` (``calibrate_decoder``, ``finetune_lm``); here is what
serves them: the generation engine (``generation``: a KV cache of the upper layers, continuous
batching of many tenants' LoRAs), token choice (``sampling``) and the runtime a server holds
(``runtime``); ``hmi.services.decoders`` holds it, ``hmi.dispatcher.routes_generate`` speaks
for it over HTTP."""
