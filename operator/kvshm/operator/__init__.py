"""kvshm.operator: the kopf operator for OffloadRegions and OffloadNodes.

Importing the package (or any module but kopf_run) registers nothing and reads no environment.
The `kvshm-operator` console script (kvshm.operator.main) registers the handlers into a registry
of its own with its flags and KVSHM_OPERATOR_* variables; `kopf run -m kvshm.operator.kopf_run`
registers them into kopf's default registry with the variables alone.
"""
