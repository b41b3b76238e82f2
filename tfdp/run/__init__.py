"""A run: its plan, the loop and its hooks, resume, checkpoints, signals, what it shows.

plan.py  the checked config, the model and the data of a run (`prepare`)
training.py  a run wired once: trainer, hooks, resume (`train`, `run`)
loop.py  the loop of steps and its hook points; hooks/ one feature each
resume.py, checkpoints.py, checkpoint_index.py  exact resume from model_dir
lock.py, signals.py, observe.py  one run per directory, stopping on a signal, the view
"""
