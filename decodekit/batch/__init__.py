"""`decodekit batch RECIPE --input FILE --output FILE`: offline batch inference over a dataset of prompts or chat
conversations, in-process or over Ray Data (`--ray --replicas N`). See docs/scale-out.md.

Modules: `rows` (the input rows, their ids and output rows), `output` (the output file: resume, append, order),
`worker` (one engine working through rows), `job` (the job: in-process or Ray), `ray_job` (Ray Data's actor pool).
"""

from decodekit.batch.job import BatchSummary, run_batch
from decodekit.batch.ray_job import RayOptions
from decodekit.batch.rows import BatchRow, InputRow, read_rows

__all__ = ["BatchRow", "BatchSummary", "InputRow", "RayOptions", "read_rows", "run_batch"]
