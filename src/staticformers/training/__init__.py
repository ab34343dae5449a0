"""The static-shape Trainer: transformers' names, fixed batch shapes, a known set of graphs, exact resume.

arguments.py / transformers_names.py (TrainingArguments and what each of transformers' names does here),
data.py / documents.py / chat_data.py (rows of exactly `[batch, max_length]`, packing, chat SFT),
step_functions.py (the compiled training and evaluation functions), trainer.py (set-up, the loop,
bookkeeping), optim.py, checkpoint_folders.py / state_files.py / state.py (atomic checkpoints, resume),
partitioned.py (what changes for a model partitioned by DistributedConfig), reporting.py, plot.py,
guards.py, adapter_training.py.

May import: distributed, backends, compilation, adapters, tokenization, models, checkpoints, utils; never
generation (independent), api, serving or commands.
"""
