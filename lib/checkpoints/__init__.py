"""A run's checkpoints and --out-dir: one interface, two implementations. A lesson imports one:

    from lib.checkpoints.one_file import Checkpoints, TrainingState  # train_dp/ddp/zero1.py
    from lib.checkpoints.sharded import Checkpoints, TrainingState   # train_fsdp.py and after

    checkpoints = Checkpoints(args)              # once the flags are checked
    resume_path = checkpoints.prepare_out_dir()  # rank 0 makes and locks it, chooses; all learn
    start_step, data_position = checkpoints.resume(resume_path, state)  # (0, None): a fresh start
    checkpoints.save(step, state, data_position)  # one_file: rank 0 writes the .pt file
    with checkpoints.saving(step, state, data_position) as (to_save, path):  # sharded: lessons
        dcp.save(to_save, checkpoint_id=path)     # dcp.save (or dcp.async_save) in between
    checkpoints.finish(state, device)            # model.pt, config.json, tokenizer.json; a sample

one_file.py: the whole model in one .pt file per step, written by rank 0. sharded.py: DCP, each
rank writing its own shards, and model.pt at the end written one tensor at a time. out_dir.py:
what both share (TrainingState, the out-dir and its lock, args.jsonl, the final files). files.py:
atomic writes and checksums, by which data.py checks the --cache-dir's files too. Imported only
when needed: resuming.py (a resume: is the checkpoint this run's?), safe_load.py (dcp.load that
runs no code from the directory), finished_run.py (a finished run's model, for
tools/generate.py, tools/export_hf.py and --init-from).
"""
