"""What a run shows of itself: bytes on the wire (meter.py), a timeline (trace.py), who a stalled
collective waits for (stall.py), gradients that go non-finite (grad_watch.py) and the terminal's tables
(display.py). A finished run's diagnosis (`gradsync doctor`) reads the main job's batch math, so it
lives with the main job: train/doctor.py."""
