"""kvshm.operator: the kopf operator for OffloadRegions and OffloadNodes.

Importing the package registers the handlers into kopf's default registry with the settings of
the environment (KVSHM_OPERATOR_*), so `kopf run -m kvshm.operator` runs the operator; the
`kvshm-operator` console script (kvshm.operator.main) does the same with flags.
"""

import kopf

from kvshm.operator.config import OperatorConfig
from kvshm.operator.main import register

register(kopf.get_default_registry(), OperatorConfig.from_env())
