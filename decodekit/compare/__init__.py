"""`decodekit compare`: recipes and their sweeps side by side on the same seeded inputs, speed and quality. The map
of the package (it imports none of its modules):

- `points`: `--sweep` parsed, every recipe at every point of its sweep, validated (`Point`);
- `plan`: the whole run checked before anything runs: points, prompts, tasks, the metrics each point can be measured
  by (`ComparePlan`);
- `run`: one point run (`run_point`): its seeded samples timed, the plain model's scoring pass, the metrics, the
  tasks; a failure recorded, never raised;
- `quality`: samples made into `SampleGroup`s, seeds, metrics scored and aggregated;
- `pareto`: the points no other beats on speed and a quality figure;
- `report`: the JSON document and the table both views print; `html` and `plots`: the self-contained HTML report.
"""
