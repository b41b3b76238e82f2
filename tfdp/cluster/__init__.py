"""The workers of a multi-worker run, apart from the engine that trains on them.

spec.py       the cluster: TF_CONFIG or Slurm, ports, telling a lost peer apart
agreement.py  what every worker must hold the same before training
exchange.py   what the processes of a run tell each other
launch.py     tfdp-launch: workers on this machine, supervised
"""
