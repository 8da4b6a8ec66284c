"""`kopf run -m kvshm.operator.kopf_run`: importing this module registers every handler into
kopf's default registry, with the settings of the environment (KVSHM_OPERATOR_*).

kopf's CLI only imports modules, so registering at import is the point of this module and of no
other: the `kvshm-operator` console script (kvshm.operator.main) never imports it.
"""

import kopf

from kvshm.operator.config import OperatorConfig
from kvshm.operator.wiring import register

register(kopf.get_default_registry(), OperatorConfig.from_env())
