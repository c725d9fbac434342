"""The `tierfs` command and the admin tools apart from the data path.

main.py parses the command line and starts the mount (tierfs.mount); the other commands
work on a mount through its control socket (ctl.py), on a cache dir at rest (fsck.py,
gc.py) or for a scheduler (slurm.py, slurmruns.py, asuser.py). reportpage.py draws the
HTML report.
"""
