"""Running a workflow on tasks: the ReAct runner and its search tool (`workflow`) and the capture of trajectories
into a trace, with resume (`runner`)."""
