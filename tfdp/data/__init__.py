"""Training data as Keras takes it, read so that a run resumes at its exact position.

inputs.py   the one way in: what Model.fit takes (or --dataset names) -> the run's streams
arrays.py   data held in memory, read by index; streams.py a pipeline read as it runs
mnist.py    the tutorial's data; sources.py a user's model and data named on the command line
epochs.py   which steps make each epoch (the input position); bad_data.py a bad record
leaves.py   one leaf of data: its examples counted, sliced and gathered
"""
