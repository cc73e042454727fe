"""Privacy protections shared by the coordinator and the workers.

``privacy.secagg``: secure aggregation (the coordinator learns only the sum of a cohort's updates).
Differential privacy lives beside it (``privacy.dp``, ``privacy.accountant``).
"""
