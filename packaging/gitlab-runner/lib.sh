# Shared by the stages of slotpool's GitLab Runner custom-executor driver (sourced).
#
# GitLab Runner runs each stage as a process of its own, with the runner's environment
# (which carries the bus settings: SLOTPOOL_NATS_URL, SLOTPOOL_NATS_CREDS, ...), the
# job's variables as CUSTOM_ENV_*, BUILD_FAILURE_EXIT_CODE and SYSTEM_FAILURE_EXIT_CODE,
# and, after the config stage, the job_env the config stage printed: SLOTPOOL_GITLAB_NODE
# (the node the job holds) and SLOTPOOL_GITLAB_STATE (a directory on the runner's host
# holding the keep-alive's pid and log).

set -u

SLOTPOOL=${SLOTPOOL:-slotpool}

# A failure of slotpool, not of the job: GitLab may retry it (retry: runner_system_failure).
system_failure() {
    printf 'slotpool: %s\n' "$*" >&2
    exit "${SYSTEM_FAILURE_EXIT_CODE:-2}"
}

# The node this job holds (set by the config stage through job_env).
job_node() {
    node=${SLOTPOOL_GITLAB_NODE:-}
    [ -n "$node" ] || system_failure "SLOTPOOL_GITLAB_NODE is not set: did the config stage run?"
    printf '%s' "$node"
}
