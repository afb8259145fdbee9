"""The same function beyond the notebook's machine: under torchrun (``torchrun.py``), the
command line's ``nbtrain run`` (``command.py``), the clusters that start ranks themselves
(``clusters.py``: SLURM, LSF, Kubeflow), a job submitted to SLURM (``slurm.py``), and the
notebook's listener that watches such jobs live (``listen.py``)."""
