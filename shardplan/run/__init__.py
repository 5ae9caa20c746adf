"""Running a plan: placing arrays, pipelined execution and schedules, devices, building named models."""
