"""Weight-update methods of the engine actor (filled in by the weight-sync work)."""


class WeightUpdateAPI:
    pass
