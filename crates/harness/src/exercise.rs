//! Exercises inside the real step: `--mine K` runs exercise NN.K with the
//! learner's code (`src/exercises.rs` of lesson NN) instead of the answer
//! (`solutions/exercises.rs`). Both modules are compiled into the lesson,
//! with the same signatures; the step calls one of them through
//! [`exercise!`](crate::exercise!), so the learner's function runs exactly
//! where the answer does, on the same numbers.
//!
//! A stub's `todo!("exercise N.K …")` is not a crash: every rank reaches it
//! at the same point of the step, and [`crate::main`] turns it into one line
//! on rank 0 naming the file to edit, and exit code 2.
use std::sync::OnceLock;

/// The running lesson's number and the exercises `--mine` switched to the learner's code.
static MINE: OnceLock<(u8, Vec<u8>)> = OnceLock::new();

/// Called once by [`crate::Session`], after the flags are checked.
pub(crate) fn set(lesson: u8, mine: Vec<u8>) {
    let _ = MINE.set((lesson, mine));
}

/// Whether exercise `lesson`.`k` runs the learner's code in this run. Lesson
/// 04's stage 3 runs lesson 03's code: lesson 03's exercises stay answers there.
pub fn mine(lesson: u8, k: u8) -> bool {
    MINE.get().is_some_and(|(l, ks)| *l == lesson && ks.contains(&k))
}

/// The exercises of this run that use the learner's code, as "2.1, 2.2".
pub fn mine_list() -> Vec<String> {
    MINE.get().map(|(l, ks)| ks.iter().map(|k| format!("{l}.{k}")).collect()).unwrap_or_default()
}

/// Checks `--mine`: each K must name one of the lesson's `count` exercises.
pub fn check(lesson: u8, count: u8, mine: &[u8]) -> Result<(), String> {
    let list = (1..=count).map(|k| format!("{lesson}.{k}")).collect::<Vec<_>>().join(", ");
    match mine.iter().find(|&&k| k == 0 || k > count) {
        None => Ok(()),
        Some(k) if count == 0 => Err(format!("--mine {k}: lesson {lesson:02} has no exercises: leave --mine out")),
        Some(k) => Err(format!(
            "--mine {k}: lesson {lesson:02} has exercises {list}: pass --mine K with K from 1 to {count} (or leave --mine out to run the answers)"
        )),
    }
}

/// Refuses `--mine k` when this run would never call exercise `lesson`.`k`
/// (`runs` false): the learner's code must not pass by not running. `when`
/// completes "exercise N.K runs only …" and names the flag to add.
pub fn needs(lesson: u8, k: u8, runs: bool, when: &str) -> anyhow::Result<()> {
    if mine(lesson, k) && !runs {
        anyhow::bail!("--mine {k}: exercise {lesson}.{k} runs only {when}");
    }
    Ok(())
}

/// What a stub's `todo!("exercise N.K: …")` panics with.
const STUB: &str = "not yet implemented: exercise ";

/// Whether a panic's message is an exercise stub's.
pub fn is_stub(panic: &str) -> bool {
    panic.starts_with(STUB)
}

/// The line rank 0 prints when a run reaches an exercise's stub, from the
/// panic message of its `todo!("exercise N.K: …")`; `None` for any other panic.
pub fn stub_message(panic: &str, lesson_dir: &str) -> Option<String> {
    let rest = panic.strip_prefix(STUB)?;
    let id: String = rest.chars().take_while(|c| c.is_ascii_digit() || *c == '.').collect();
    let k = id.split('.').nth(1).unwrap_or("K");
    Some(format!(
        "exercise {id} is not written yet: replace the todo!() under `TODO(exercise): {id}` in crates/{lesson_dir}/src/exercises.rs (hints in the book's chapter; leave out --mine {k} to run the answer)"
    ))
}

/// `exercise!(2, 1, update_my_shard(a, b))`: the learner's
/// `crate::mine::update_my_shard(a, b)` under `--mine 1` in lesson 02,
/// otherwise the answer, `crate::answers::update_my_shard(a, b)`.
// `crate::` is meant: the calling lesson's own `mine` and `answers` modules.
#[allow(clippy::crate_in_macro_def)]
#[macro_export]
macro_rules! exercise {
    ($lesson:literal, $k:literal, $f:ident ( $($arg:expr),* $(,)? )) => {
        if $crate::exercise::mine($lesson, $k) {
            crate::mine::$f($($arg),*)
        } else {
            crate::answers::$f($($arg),*)
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stub_names_its_file_and_the_way_back() {
        let m = stub_message("not yet implemented: exercise 2.1: take your shard", "02-whole-model-shard").unwrap();
        assert_eq!(
            m,
            "exercise 2.1 is not written yet: replace the todo!() under `TODO(exercise): 2.1` in crates/02-whole-model-shard/src/exercises.rs (hints in the book's chapter; leave out --mine 1 to run the answer)"
        );
        assert_eq!(stub_message("index out of bounds", "x"), None);
        assert_eq!(stub_message("not yet implemented", "x"), None);
    }

    #[test]
    fn mine_must_name_an_exercise_of_the_lesson() {
        assert!(check(2, 2, &[1, 2]).is_ok() && check(2, 2, &[]).is_ok());
        assert_eq!(
            check(2, 2, &[3]).unwrap_err(),
            "--mine 3: lesson 02 has exercises 2.1, 2.2: pass --mine K with K from 1 to 2 (or leave --mine out to run the answers)"
        );
        assert!(check(2, 2, &[0]).is_err());
        assert!(check(5, 0, &[1]).unwrap_err().contains("no exercises"));
    }
}
