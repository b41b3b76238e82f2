"""The workers of a multi-worker run, apart from the engine that trains on them.

spec.py       the cluster: TF_CONFIG or Slurm, ports, telling a lost peer apart
agreement.py  what every worker must hold the same before training
exchange.py   what the processes of a run tell each other
launch.py     tfdp-launch: its flags, the command
elastic.py    its supervisor: starts the cluster again on failures and new members
hosts.py      the hosts discovery offers, and those left out after failing
workers.py    one start of the cluster: TF_CONFIGs, processes here and over ssh
remote.py     a worker on another host, taking the launcher's signals from ssh
network.py    the workers' own network namespace, with only loopback
"""
