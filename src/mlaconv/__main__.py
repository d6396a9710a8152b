from mlaconv.cli import main

main()
