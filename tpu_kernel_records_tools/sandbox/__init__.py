"""The sandbox a stranger's code runs in: a worker process per candidate, its isolation (bubblewrap, a memory
cgroup, a system-call filter), the framed protocol the grader speaks to it, and the tripwire on the grader's
own files. It knows nothing of what the candidate computes: the worker serves whatever service its caller names."""
