from service.cli import main

if __name__ == "__main__":  # not when multiprocessing spawns a tensor-parallel rank
    main()
