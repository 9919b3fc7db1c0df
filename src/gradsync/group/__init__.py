"""How ranks start and meet: spawn's processes (launch.py, forkserver.py, job_signals.py,
spawn_report.py), the process group each joins (runtime.py: gradsync.init, or join.py inside a
script's own group), what a rank knows of its world (world_info.py), and the path its CUDA tensors
take (device_path.py)."""
