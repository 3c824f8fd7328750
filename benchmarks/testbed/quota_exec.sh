#!/bin/sh
# Join this rank's CPU cgroups, then become the rank (benchmarks/testbed/quota.py): every instruction
# of the rank, of its threads and of its children runs under its quota, start-up included.
#   PLANC_QUOTA_CGROUPS  the parent cgroup folders, ':'-separated; the rank's own is <folder>/rank$RANK
#   RANK                 the rank
# Two forms:
#   quota_exec.sh -- CMD [ARG...]                          exec CMD ARG...
#   quota_exec.sh --local_rank=N PYTHON SCRIPT [ARG...]    DeepSpeed's launch with --no_python calls it so:
#                                                          exec PYTHON -u SCRIPT --local_rank=N ARG...
#                                                          (what that launch runs without --no_python)
set -f
IFS=:
for d in $PLANC_QUOTA_CGROUPS; do
    if ! { echo $$ > "$d/rank$RANK/cgroup.procs"; } 2>/dev/null; then
        echo "planc testbed: rank $RANK could not join its CPU cgroup $d/rank$RANK" >&2
        exit 1
    fi
done
unset IFS
case "$1" in
    --) shift; exec "$@" ;;
    --local_rank=*) lr=$1; py=$2; script=$3; shift 3; exec "$py" -u "$script" "$lr" "$@" ;;
esac
echo "quota_exec.sh: expected -- CMD or --local_rank=N PYTHON SCRIPT, not: $*" >&2
exit 2
