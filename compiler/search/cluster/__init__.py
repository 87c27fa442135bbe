"""`kiln search --ray ADDRESS`: each candidate's compile and gate as a task on a Ray cluster.

A candidate is one Ray task with declared resources (`num_gpus`, `num_cpus`) that calls the
judging code the serial search calls (search/judge.py) and returns the candidate's row
(worker.py); Ray runs it again once when its worker dies (`max_retries=1`). The driver
(driver.py) is a loop over `ray.wait`: it keeps as many candidates running as the cluster has
room for, cheapest first, saves `state.json` as each one finishes, and prints what runs, what
finished, what is queued and the ETA. The mixed-precision probes of k run several at once
(search/probes.py) and reach the serial search's answer. SIGTERM or Ctrl-C cancels every
running task before the driver exits.

Refused before any work (exit 2): an address where no Ray cluster answers, a cluster with no
node that holds one candidate's resources (connect.py), a worker that does not see the search
directory, the registry, the recipe or the source checkpoint as the driver does, or that
runs other tool versions (storage.py). Candidates share storage every node mounts at the same
path; each compiles into its own output directory (`artifacts/<candidate>/`: `kiln compile`
holds its output directory's lock while it runs), whose stage cache starts with the float
source stage that the driver made once and hard-linked in.

Ray is imported only inside these modules' functions, when a search asks for a cluster:
`kiln` without Ray installed still searches serially. This file imports nothing, so the
node probe (look.py) starts a cold worker quickly. Ours: no library runs a gated search on
a cluster.
"""
