"""--log mlflow: an MLflow run in a local file store, RUN_DIR/mlruns/ (MLFLOW_TRACKING_URI chooses
another store), experiment "gradsync" (MLFLOW_EXPERIMENT_NAME another).

The run is the one tagged gradsync.run = the run key, created by the first record and found again by
every resume and by a reporting rank taking over a live run, so the run's metrics are one history.
A resume records no step at or below the highest one the run already holds (what an earlier attempt
recorded after its checkpoint stays, once). MLflow 3 keeps the file store only on request
(MLFLOW_ALLOW_FILE_STORE=true, set here for the local store): it is one directory beside the run's
checkpoint, with no server or database to start.
"""

from __future__ import annotations

import os
import time

from gradsync.train.trackers.base import Tracker

STORE_DIR = "mlruns"
EXPERIMENT = "gradsync"
RUN_TAG = "gradsync.run"


def store_uri(run_dir) -> str:
    """The tracking store: MLFLOW_TRACKING_URI, else the file store in ``run_dir``."""
    return os.environ.get("MLFLOW_TRACKING_URI") or (run_dir / STORE_DIR).resolve().as_uri()


class MlflowTracker(Tracker):
    name = "mlflow"

    def __init__(self, run_dir, run_key, purge_after) -> None:
        super().__init__(run_dir, run_key, purge_after)
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        self.client = client = MlflowClient(tracking_uri=store_uri(self.run_dir))
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or EXPERIMENT
        experiment = client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(name)
        found = client.search_runs([experiment_id], filter_string=f"tags.`{RUN_TAG}` = '{run_key}'", max_results=1)
        if found:
            self.run_id = found[0].info.run_id
            client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = client.create_run(experiment_id, run_name=f"{self.run_dir.name}-{run_key}",
                                            tags={RUN_TAG: run_key}).info.run_id
        self.recorded_to = -1
        if found and purge_after is not None:
            held = client.get_run(self.run_id).data.metrics
            self.recorded_to = max((m.step for key in held for m in client.get_metric_history(self.run_id, key)),
                                   default=-1)

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        if step <= self.recorded_to:
            return
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in values.items()])

    def finish(self, done: bool) -> None:
        self.client.set_terminated(self.run_id, status="FINISHED" if done else "KILLED")
