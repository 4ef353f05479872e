"""An engine set's life, whichever the backend: its one spec (`spec`:
`EngineSetSpec`, checked on the driver before anything exists), where it
goes (`placement`: `Placement`, `PlacementMode`), one engine actor's class,
options and start (`actors`), the set once started (`handles`: `EngineSet`,
`Spare`, `Prepared`), its start, restart, replacement and destruction
(`engine_set`), its warm spares (`spares`) and its prepared actors
(`prepared`)."""

from engines.lifecycle.engine_set import (
    destroy_engines,
    replace_engine,
    resolve_backend,
    restart_engine,
    start_engine_set,
)
from engines.lifecycle.handles import EngineSet, Prepared, Spare
from engines.lifecycle.placement import Placement, PlacementMode, check_cluster_fits
from engines.lifecycle.prepared import adopt_prepared
from engines.lifecycle.spares import swap_in_spare
from engines.lifecycle.spec import EngineSetSpec

__all__ = [
    "EngineSet",
    "EngineSetSpec",
    "Placement",
    "PlacementMode",
    "Prepared",
    "Spare",
    "adopt_prepared",
    "check_cluster_fits",
    "destroy_engines",
    "replace_engine",
    "resolve_backend",
    "restart_engine",
    "start_engine_set",
    "swap_in_spare",
]
