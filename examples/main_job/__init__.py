"""The parts of the main job (``examples/composer_main.py``): its phases (``job``), tasks, teacher, policy,
evaluation, replica, report, and the agentic job (``agent``, ``agent_job``)."""
