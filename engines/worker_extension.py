"""Weight-update methods that run where the model lives (filled in by the
weight-sync work)."""


class WeightSyncWorkerExtension:
    def _model(self):
        return self.model_runner.model
