"""What a run shows of itself: bytes on the wire (meter.py), a timeline (trace.py), who a stalled
collective waits for (stall.py), gradients that go non-finite (grad_watch.py), the terminal's tables
(display.py) and a finished run's diagnosis (doctor.py: `gradsync doctor`)."""
