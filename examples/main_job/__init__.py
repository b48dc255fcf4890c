"""The parts of the main job (``examples/composer_main.py``): tasks, teacher, policy, evaluation, replica, report."""
