"""What the course notebooks and labs import: quizzes, the memory calculator, lab checkers."""
