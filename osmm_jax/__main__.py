"""``python -m osmm_jax``: print the environment report (versions, the MPI library and its ABI,
the thread level, which native handlers loaded and why one did not, devices, transport hints,
the OSMM_* settings). See README, "Troubleshooting"."""

from osmm_jax._src.environment import report

print(report())
