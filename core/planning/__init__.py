"""How experts are used (the routing profile), what to build for them (the planner), and what it costs (the cost
model)."""
