"""The library's second tier: what a flag brings in, imported only where that flag is handled
(--streaming, --data files or a hub dataset, --tokenizer, --config, --micro-batch-size auto,
--plan, --optimizer muon, --num-experts, --compile, --activation-checkpointing, --num-workers,
--tensorboard, ranks started without torchrun, and the final sample)."""
