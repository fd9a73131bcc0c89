"""`omni-pd plan`: each layout's goodput predicted from measured step costs (a `bench roofline`
profile): step costs fitted to the profile (costs.py), the engine's step rule on plain numbers
(engine_sim.py), arrivals, the router and the P/D handoff simulated per layout (simulate.py),
goodput under SLOs (slo.py), a recommendation (planner.py), predicted against measured
(compare.py). A tool beside `bench`: it reads files and may run a profile."""
