"""The parallel strategies, one module each, all of one shape: `add_flags(parser)`, `setup(parser,
args, world_size, device)` -> the run's Layout (checked flags, and the device mesh), and
`describe(layout)` -> the start-up line. A lesson swaps one module for another and nothing else.
replica.py is train_dp.py's (nn.DataParallel); fsdp.py train_fsdp.py's; tensor_parallel.py,
pipeline.py, context_parallel.py and expert_parallel.py those of the lessons named after them."""
